"""Adapters that let other trainers score with a running `mmrl serve` (see `mmrl.server`).

- `mmrl.integrations.verl`: veRL's custom reward function, `compute_score(data_source,
  solution_str, ground_truth, extra_info)` (and a batched variant for veRL's batch reward manager).
- `mmrl.integrations.trl`: `make_reward_function(...)`, a TRL reward function
  `(prompts, completions, **kwargs) -> list[float]`.

OpenRLHF and V-Triune need no adapter: point `--remote_rm_url` at `http://host:port/get_reward`,
or V-Triune's reward proxy at the server (it calls `/judge`).

Both adapters read the server's address from $MMRL_REWARD_URL and its token from
$MMRL_REWARD_TOKEN unless given explicitly. Neither imports veRL or TRL.
"""
