"""HACPO: heterogeneous agents that share verified rollouts, trained together on verl."""

__version__ = "0.1.0"
