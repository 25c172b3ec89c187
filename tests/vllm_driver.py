"""`python tests/vllm_driver.py [hydra overrides]`: `python -m recipe_hacpo.main` with three hooks
the vLLM tier's tests use to look inside a run. Neither changes what the trainer computes unless
asked for; both live here, not in the package.

- HACPO_TEST_ACTORS_FILE=PATH: once every agent's workers and rollout servers are up, write
  the names of the Ray cluster's named actors to PATH (JSON list): the per-agent server names.
- HACPO_TEST_FREEZE_ROLLOUT=AGENT: that agent's rollout servers get its weights once (the
  initial sync) and never again; its trainer side goes on as if every sync had happened. The
  negative control of the weight-sync check: the engine's log-probs must then stop matching.
  Works for both rollout backends (vllm and hf).
- HACPO_TEST_HOLD_ROLLOUT=STEP:PATH: in step STEP every agent's rollout is sent to its servers
  as usual, and then the trainer holds: it appends the agent's name to PATH and waits there
  forever. A test that kills the run once PATH names every agent kills it mid-rollout, whatever
  the machine's speed.
"""

from __future__ import annotations

import json
import os


def _record_named_actors(path: str) -> None:
    from recipe_hacpo.training.trainer import HacpoTrainer

    init_workers = HacpoTrainer.init_workers

    def recording(self, *args, **kwargs):
        init_workers(self, *args, **kwargs)
        import ray

        names = sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True))
        with open(path, "w") as f:
            json.dump(names, f)

    HacpoTrainer.init_workers = recording


def _freeze_rollout(agent: str) -> None:
    from recipe_hacpo.training.agent_runtime import AgentRuntime

    sync_weights = AgentRuntime.sync_weights

    def frozen(self, step):
        if self.spec.name == agent and getattr(self, "_test_synced_once", False):
            if self.config.actor_rollout_ref.rollout.name == "hf":
                # the hf servers refuse to generate while marked asleep; they hold their weights
                # through sleep on CPU, so waking them keeps the stale weights in place
                import ray

                ray.get([s.wake_up.remote() for r in self.llm_servers.get_replicas() for s in r.servers])
            self.weights_version = step
            self._rollout_awake = True
            return
        self._test_synced_once = True
        sync_weights(self, step)

    AgentRuntime.sync_weights = frozen


def _hold_rollout(spec: str) -> None:
    import threading
    import time

    from recipe_hacpo.training.agent_runtime import AgentRuntime

    step_text, path = spec.split(":", 1)
    held_step = int(step_text)
    generate = AgentRuntime.generate

    def holding(self, prompts, *args, **kwargs):
        if kwargs.get("step") != held_step or kwargs.get("validate"):
            return generate(self, prompts, *args, **kwargs)
        sent = threading.Thread(target=generate, args=(self, prompts, *args), kwargs=kwargs, daemon=True)
        sent.start()
        with open(path, "a") as f:
            f.write(self.spec.name + "\n")
        while True:  # until the test kills the run
            time.sleep(1.0)

    AgentRuntime.generate = holding


if __name__ == "__main__":
    if os.environ.get("HACPO_TEST_ACTORS_FILE"):
        _record_named_actors(os.environ["HACPO_TEST_ACTORS_FILE"])
    if os.environ.get("HACPO_TEST_FREEZE_ROLLOUT"):
        _freeze_rollout(os.environ["HACPO_TEST_FREEZE_ROLLOUT"])
    if os.environ.get("HACPO_TEST_HOLD_ROLLOUT"):
        _hold_rollout(os.environ["HACPO_TEST_HOLD_ROLLOUT"])
    from recipe_hacpo.main import main

    main()
