"""verl worker roles and rollout backends of HACPO."""
