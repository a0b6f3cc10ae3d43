"""When a failed startup load is tried again: which failures can pass without an edit, and the
back-off between tries. Pure decisions; the pool (pool.py) carries them out."""
from __future__ import annotations

from proxy.config.settings import ServiceSettings
from proxy.errors import PoolError
from proxy.supervisord.supervisor import SupervisorError


def retry_delay(service: ServiceSettings, attempt: int) -> float:
    """The wait after failed try number `attempt` (1, 2, ...): doubled per try, bounded."""
    return min(service.load_retry_max_s, service.load_retry_base_s * 2.0 ** (attempt - 1))


def worth_retrying(exc: BaseException) -> bool:
    """Whether a failed load can pass without an edit: a provider or supervisord not answering yet,
    replicas that did not become healthy, no free port (5xx), and not a problem of the settings
    (a 4xx: a backend this version cannot run, a missing file or key variable)."""
    if isinstance(exc, PoolError):
        return exc.status >= 500
    return isinstance(exc, (SupervisorError, OSError))
