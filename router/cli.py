"""``epdserve router``: the cache-aware OpenAI gateway (no torch)."""

from __future__ import annotations

import argparse
import sys

from epdserve.common.cli_fields import add_fields, from_args
from epdserve.router.config import RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags: the fields of ``RouterConfig`` (the operator uses exactly these)."""
    add_fields(parser, RouterConfig)


ROLE_LABEL = "epdserve.io/role"


def build(config: RouterConfig):
    """The FastAPI app for this config (tests call this too)."""
    from epdserve.common.prompt_signing import PromptSigner
    from epdserve.router.app import build_app
    from epdserve.router.disagg import DisaggRouters
    from epdserve.router.discovery import KubernetesDiscovery, RoleDiscovery, StaticDiscovery
    from epdserve.router.index import PrefixIndex
    from epdserve.router.metrics import RouterMetrics
    from epdserve.router.pods import PodEndpoint
    from epdserve.router.seedcheck import RootHashCheck
    from epdserve.router.service import Router
    from epdserve.router.strategy import make_strategy
    from epdserve.router.tokenize import PromptTokenizer

    c = config
    events = c.event_options()
    strategy = make_strategy(c.strategy, **c.strategy_weights())
    tokenizer = PromptTokenizer(c.model) if c.model else None
    replay = c.kv_replay_port or None
    metrics = RouterMetrics()
    root_check = RootHashCheck(metrics)  # one per pool: every role's pods must agree
    lora_policy = c.adapter_policy()

    def new_router(role="colocated", role_strategy=strategy) -> Router:
        return Router(
            role_strategy,
            tokenizer,
            c.served_model_name,
            PrefixIndex(c.index_capacity),
            metrics=metrics,
            speculative_ttl=c.speculative_ttl,
            default_block_size=c.block_size,
            root_check=root_check,
            engine_role=role,
            event_options=events,
            lora_policy=lora_policy,
        )

    def disagg_routers() -> DisaggRouters:
        encoder = new_router("encoder", make_strategy("least-load"))
        key = c.processed_prompt_key
        signer = PromptSigner(key) if key else None
        return DisaggRouters(new_router("prefill"), new_router("decode"), encoder, signer)

    router = new_router()
    disagg = None
    if c.discovery == "static":
        endpoints = [PodEndpoint.parse(u, c.kv_events_port, replay) for u in c.endpoint]
        pairs = [(router, StaticDiscovery(endpoints))]
        if c.prefill_endpoint or c.decode_endpoint:
            disagg = disagg_routers()
            for role_router, specs in (
                (disagg.prefill, c.prefill_endpoint),
                (disagg.decode, c.decode_endpoint),
                (disagg.encoder, c.encoder_endpoint),
            ):
                eps = [PodEndpoint.parse(u, c.kv_events_port, replay) for u in specs]
                pairs.append((role_router, StaticDiscovery(eps)))
    else:

        def k8s(selector: str) -> KubernetesDiscovery:
            return KubernetesDiscovery(
                c.namespace,
                selector,
                c.target_port,
                c.kv_events_port,
                replay,
                kubeconfig=c.kubeconfig,
            )

        if ROLE_LABEL in c.selector:  # the caller already picked one role
            pairs = [(router, k8s(c.selector))]
        else:  # a whole pool: split its pods by role
            disagg = disagg_routers()
            pairs = [(router, k8s(f"{c.selector},{ROLE_LABEL}=colocated"))]
            for role in ("prefill", "decode", "encoder"):
                pairs.append((getattr(disagg, role), k8s(f"{c.selector},{ROLE_LABEL}={role}")))
    return build_app(router, c.proxy_settings(), RoleDiscovery(pairs), disagg)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    import uvicorn

    from epdserve.common.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        config = from_args(RouterConfig, args)  # every flag checked here, once
        app = build(config)
    except ValueError as exc:
        print(f"epdserve router: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        log_config=None,  # uvicorn's loggers propagate to ours (text or json)
        access_log=config.access_log,
        timeout_graceful_shutdown=5,
        # concurrency limit, keep-alive, header deadline (body: in the app)
        **config.http_limits().uvicorn_options(),
    )
    return 0
