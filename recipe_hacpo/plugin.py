"""Entry point of the `verl.plugins` group: verl imports it on `import verl` in every process."""
