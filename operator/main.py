"""kopf handlers for InferencePool (thin: all logic is in reconcile and the pure builders).

Run with `epdserve operator` or `kopf run -m epdserve.operator.main --standalone`.
`EPDSERVE_OPERATOR_RESYNC_SECONDS` (default 30) sets the drift-repair/status period.
"""

from __future__ import annotations

import logging
import os

import kopf

from epdserve.operator.autoscaler import Autoscaler
from epdserve.operator.kube import Kube, load_configuration
from epdserve.operator.meta import MANAGED_BY as MANAGER
from epdserve.operator.meta import POOL_LABEL
from epdserve.operator.reconcile import reconcile
from epdserve.operator.resync import Resyncer, now
from epdserve.operator.spec import GROUP, PLURAL, VERSION

RESYNC_SECONDS = float(os.environ.get("EPDSERVE_OPERATOR_RESYNC_SECONDS", "30"))
RETRY_DELAY = float(os.environ.get("EPDSERVE_OPERATOR_RETRY_SECONDS", "5"))
RESOURCE = (GROUP, VERSION, PLURAL)
MANAGED = "app.kubernetes.io/managed-by"


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    """Standalone (no peering CRD), annotation-based bookkeeping, no finalizer (no handler
    needs one: owner references clean up), bounded backoffs; start the resync loop."""
    settings.peering.standalone = True
    settings.persistence.finalizer = f"{GROUP}/finalizer"  # unused: no handler requires one
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # Events for warnings and our own reports only
    settings.networking.error_backoffs = [1, 2, 5, 10, 20, 30]
    settings.networking.request_timeout = 60
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.reconnect_backoff = 1.0
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]
    memo.kube = Kube()
    memo.resyncer = Resyncer(memo.kube, RESYNC_SECONDS, Autoscaler(memo.kube))
    memo.resyncer.start()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_) -> None:
    """Stop the resync loop and release the API client's connection pool."""
    if getattr(memo, "resyncer", None) is not None:
        await memo.resyncer.stop()
    if getattr(memo, "kube", None) is not None:
        memo.kube.close()


@kopf.on.login()
def login(logger: logging.Logger, settings: kopf.OperatorSettings, **_) -> kopf.ConnectionInfo:
    """Credentials from the pod's ServiceAccount or from $KUBECONFIG (read at start, not import)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return kopf.login_with_service_account(settings=settings, logger=logger)
    cfg = load_configuration()
    token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    scheme, _, token = (token or "").rpartition(" ") if token else ("", "", None)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def reconcile_pool(body, meta, patch, memo, logger, **_) -> None:
    """Create/update/resume: apply the whole desired state now, write the status."""
    with memo.resyncer.lock(meta["namespace"], meta["name"]):
        outcome = reconcile(memo.kube, dict(body), now(), announce=True)
    for change in outcome.changed:
        logger.info(change)
    if outcome.status:
        patch.status.update(outcome.status)
    for etype, reason, message in outcome.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    if outcome.recheck:
        memo.resyncer.mark_later(meta["namespace"], meta["name"])
    if outcome.retry == "temporary":
        raise kopf.TemporaryError(f"API error, will retry: {outcome.error}", delay=RETRY_DELAY)
    if outcome.retry == "permanent":
        # Retrying cannot help: the spec (or a cluster policy) must change. The resync loop
        # keeps looking, so a fixed policy heals without a spec change.
        raise kopf.PermanentError(outcome.error)


@kopf.on.event("apps", "v1", "deployments", labels={POOL_LABEL: kopf.PRESENT, MANAGED: MANAGER})
async def child_changed(namespace, labels, memo, **_) -> None:
    """A child Deployment changed (status, hand edit, deletion): resync its pool soon."""
    memo.resyncer.mark(namespace, labels[POOL_LABEL])


@kopf.on.delete(*RESOURCE, optional=True)
def pool_deleted(name, logger, **_) -> None:
    """Nothing to undo: owner references let the garbage collector delete the children.

    `optional=True` keeps kopf from adding a finalizer just for this handler.
    """
    logger.info("pool %s deleted; children are garbage-collected", name)
