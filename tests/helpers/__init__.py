"""What the tests share, in one place (imported as `helpers.<module>`; fixtures are in conftest.py):

    compose.py   the Hydra composition of a shipped config, as `python -m recipe_hacpo.main` does
    e2e.py       running `python -m recipe_hacpo.main` from a test and what the end-to-end tests
                 check of a run (its metric records, learner batches, trained weights)
    golden.py    the golden training metrics of every method's end-to-end run (tests/golden/)
"""
