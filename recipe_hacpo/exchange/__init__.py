"""The re-tokenization of one agent's rows for another: a peer's rollouts in a learner's tokens.

    retokenize.py   RolloutExchange: decode, render the learner's chat template, re-encode, cut
    jobs.py         the same conversions on background threads from the moment a source's
                    rollouts return (`trainer.exchange_workers`)

Used by the training step (the exchange phase hands the converted rows to the method) and by
the methods through `StepContext.convert`; imports nothing of methods/ or training/.
"""
