"""`stagectl eval`'s part of a config (`EvalSession`), resolved once by the command: the held-out eval
(`EvalPlan`, the same part train-ab's periodic eval gets), the model whose tokenizer parses the answers (and
that generates them, without `--server`), and the rollout server of `--server`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from stagectl.config.model_data import ModelConfig
from stagectl.config.plan import EvalPlan, ServerList, eval_plan
from stagectl.config.rollout import check_server_url
from stagectl.config.root import StagectlConfig


@dataclass(frozen=True)
class EvalSession:
    """What `stagectl eval` runs."""

    eval: EvalPlan
    model: ModelConfig
    # `--server URL`: rollouts from it, with the token, TLS and timeouts of
    # `custom.extra.rollout_matching.vllm.server` (its `servers` list is not used); None: in process
    server: ServerList | None = None


def eval_session(cfg: StagectlConfig, server_url: str | None = None) -> EvalSession:
    """Resolve a validated config for `stagectl eval` (`ValueError` when it has no `data.eval`, or when
    `server_url`, `--server`, cannot name a rollout server)."""
    if (
        server_url is not None
    ):  # before anything else: a URL no request can reach waited timeout_s for /health/
        try:
            check_server_url(server_url)
        except ValueError as exc:
            raise ValueError(f"--server: {exc}") from None
    plan = eval_plan(cfg)
    if plan is None:
        raise ValueError(  # eval and validate-config --for eval both take --set; only eval has --data
            "nothing to evaluate (no data.eval): set data.eval (stagectl eval --data JSONL, or --set "
            "data.eval.jsonl=JSONL)"
        )
    server = None
    if server_url is not None:
        rm = cfg.custom.extra.rollout_matching
        server = replace(ServerList.of_rollout_matching(rm), base_urls=(server_url,))
    return EvalSession(eval=plan, model=cfg.model, server=server)
