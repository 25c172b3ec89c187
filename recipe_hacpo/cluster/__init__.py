"""Where a run goes and how it survives: GPUs, nodes, faults, stops.

    placement.py    Ray resource pools per agent or shared, the cluster check, port ranges
    planner.py      the memory plan and GPU layout of a config (`trainer.plan_only`)
    time_model.py   the time of a lockstep step per agent and phase, its check against a recorded
                    run, the best static GPU split (`trainer.plan_only`)
    reliability.py  the newest complete checkpoint, non-finite checks, one-line worker failures
    preemption.py   stopping to be resumed: signals, deadlines, Slurm's end time, exit 75
"""
