"""Verifiable math reward in verl custom-reward-function form."""
