"""The `hf` rollout backend: a CPU stand-in for verl's vLLM servers (`actor_rollout_ref.rollout.name=hf`).

Transformers' `generate` behind verl's rollout-replica and server interfaces, so the whole
trainer runs on a machine without a GPU or vLLM (the CPU demo, the fast test tier). Nothing on
the GPU path imports it; verl's vLLM servers (workers/vllm_rollout.py) are the production path.

    hf_rollout.py     replica and worker adapter (registered by workers/verl_touchpoints.py)
    hf_server.py      the server actor: request batching, abort gates, memory phases
    hf_engine.py      the HF model: batched generate, weight loading
    hf_sampling.py    verl's sampling dict -> `Sampling`
    hf_agent_loop.py  verl's single-turn agent loop, batched (one server call per batch)
"""
