"""The fields HACPO adds to verl's `DataProto`, declared once.

Shapes: B rows (responses), T learner response tokens. verl's own keys (`input_ids`,
`attention_mask`, `position_ids`, `responses`, `response_mask`, `old_log_probs`,
`advantages`, `token_level_scores`, `uid`, `raw_prompt`, `data_source`, `reward_model`)
keep their verl meaning and are not repeated here.
"""

# batch (tensors)
SOURCE = "hacpo_source"
"""int64 [B] — index j of the agent that generated the response (its position in `agents:`)."""

IS_CROSS = "hacpo_is_cross"
"""bool [B] — True when the response came from another agent than the learner of this batch."""

OMEGA = "hacpo_omega"
"""float32 [B] — capability discrepancy coefficient ω^(src,k) of spec §3; 1.0 on own rows."""

SOURCE_LOG_PROB_MEAN = "hacpo_source_log_prob_mean"
"""float32 [B] — mean over the source's own tokens of log π^(src)_old(y_i); the source term of §4."""

SOURCE_RESPONSE_LENGTH = "hacpo_source_response_length"
"""float32 [B] — |y^(src)|, the response's token count under its source's own tokenisation;
with SOURCE_LOG_PROB_MEAN it gives the source's summed log-prob (§4, cross_ratio_length=source)."""

REWARD = "hacpo_reward"
"""float32 [B] — scalar verifier reward R_i of the response (shared by every learner)."""

GROUP_ADVANTAGE = "hacpo_group_advantage"
"""float32 [B] — mode=graft: GRPO advantage of the response within its generating agent's own
full group (G2); a grafted row keeps its source's value."""

GRAFT_WEIGHT = "hacpo_graft_weight"
"""float32 [B] — mode=graft: compatibility weight w of G3 (1.0 on own rows, 0.0 on grafted rows
the floor dropped, whose response_mask is zeroed)."""

IMITATION_MASK = "hacpo_imitation_mask"
"""int64 [B, T] — mode=sgt: 1 on the response tokens of an imitated peer response (the tokens of
the λ·NLL term), 0 elsewhere. Every row of the imitation slot (one per prompt group) has a zero
response_mask, so it is in neither GRPO's loss nor its token count; a slot whose prompt has
nothing to imitate is zero here as well."""

SELECTED = "hacpo_selected"
"""bool [B] — share_selection=complementary (mode hacpo / naive) only: True on own rows and on a
peer S's rows of the prompts GRAFT's selection gives this learner from S (§9). A False row keeps
its place (every prompt group keeps its size for the mini-batch layout) with a zeroed
response_mask and advantage 0: it is in neither the loss, its token and row counts, nor the §2
group statistics. Absent under share_selection=all."""

ROW = "hacpo_row"
"""int64 [B] — the row's position in its learner batch as the trainer built it, set by
`AgentRuntime.update` before the update order permutes the rows: the loss's per-row record
(ratio, clip) names rows by it (recipe_hacpo/training/rollout_log.py)."""

# non_tensor_batch (numpy object arrays)
RESPONSE_TEXT = "hacpo_response_text"
"""object [B] — decoded response text (no special tokens); what crosses tokenizers."""

FINISHED = "hacpo_finished"
"""bool-like object [B] — the source stopped on its EOS (not on the length limit)."""

# meta_info / non-tensor scalars passed to the worker
UPDATE_INDEX = "hacpo_update_index"
"""int — m of spec §5: optimizer updates the learner already made in this training step."""

LOSS_ROWS = "hacpo_loss_rows"
"""int — share_selection=complementary: SELECTED rows of the whole mini-batch over every
data-parallel rank, set per mini-batch by `HacpoTrainingWorker`: the seq-mean denominator of the
HACPO loss in place of verl's `global_batch_size` (every row of the mini-batch)."""

IMITATION_TOKENS = "hacpo_imitation_tokens"
"""int — mode=sgt: imitated tokens (Σ IMITATION_MASK) of the whole mini-batch over every
data-parallel rank, set per mini-batch by `HacpoTrainingWorker`: the NLL term's token-mean
denominator, as verl's `batch_num_tokens` is GRPO's."""
