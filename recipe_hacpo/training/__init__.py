"""The training step and what runs it.

    trainer.py        HacpoTrainer: `train_step` (one step of spec §7, a named method per phase)
                      and `fit` (validation, checkpoints, resume, stopping to be resumed)
    agent_runtime.py  one agent's verl machinery: worker group, rollout servers, weight sync
    scoring.py        the verifier: rewards of every response, with deadlines
    run_metrics.py    metrics.jsonl, TensorBoard, wandb; the validation samples
    rollout_log.py    `trainer.rollout_data_dir`: each learner's rows and what the loss did with them
    progress.py       plain progress lines off a terminal
    run_identity.py   what trained a checkpoint (run_identity.json), checked before a resume

It asks the method (methods/) for everything in which methods differ and the exchange
(exchange/) to convert rows; cluster/ places and protects it.
"""
