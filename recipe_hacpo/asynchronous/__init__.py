"""Agents that do not wait for each other (level A): each agent steps at its own pace and takes its
peers' verified rows from a versioned buffer with a bounded lag.

    schedule.py       which batch of prompts an agent answers next (the window rule)
    buffer.py         published rows, versions, lag bound, consumption manifests
    capability.py     each agent's P̂ series, for ω at the version that sampled
    loop.py           one agent's loop, as a generator of phases (shared by every executor)
    virtual_clock.py  the loops one event at a time in virtual time: deterministic
    simulate.py       predictions from per-agent phase costs (synthetic agents)
"""
