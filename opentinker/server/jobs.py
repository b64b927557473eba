"""Jobs: a run spec checked and stored as the job record, one Prefect flow run per attempt, the job's state read back.

The spec is the same typed object ``opentinker train`` resolves (``RunSpec``, any algorithm), checked at submit
with the same one-line errors; the server fills the fields that are its own: ``run_name`` (the job id: the run's
directory and resume key), ``experiment`` and the ``model_name`` prefix (the tenant's), and ``resume=True`` (a retried
or resumed attempt continues from the job's last checkpoint; a first attempt has none). Quotas are checked before
anything is made; the running-jobs quota is the tenant's Prefect work queue limit, so over it a job waits in the
queue.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import Any

import sqlalchemy as sa

from opentinker.flows.params import ConfigError, load_spec
from opentinker.infra.settings import Settings
from opentinker.tasks.spec import RunSpec

from . import tenants
from .db import Job, Store, Tenant, Upload
from .env_check import EnvCheck, merge_resolved
from .errors import Conflict, Invalid, NotFound, OverQuota
from .orchestration import PRIORITY_STEP, Orchestrator
from .packaging import top_package
from .schemas import FINAL_STATES, JobOut, JobSubmit, Progress, QueueInfo

SERVER_FIELDS = {
    "run_name": "the job id names the run",
    "experiment": "the tenant's experiment",
    "resume": "every attempt resumes from the job's last checkpoint; use POST /v1/jobs/{id}/resume",
}
RETRY_AFTER_S = 30
"""What a submit over a quota is told to wait (``Retry-After``)."""
HANDOFF_WAIT_S = 60.0
"""How long a submit waits for its job's flow run (Prefect's own database timeout)."""
HANDOFF_RETRY_MAX_S = 30.0
logger = logging.getLogger("opentinker.server")
VIEW_TTL_S = 0.2
POOL_TTL_S = 2.0


class JobBoard:
    """Submit, read, cancel and resume the jobs of a ``Store`` through an ``Orchestrator``."""

    def __init__(self, store: Store, orchestrator: Orchestrator, env_check: EnvCheck, settings: Settings):
        self.store = store
        self.settings = settings
        self.orchestrator = orchestrator
        self.env_check = env_check
        self._submit_lock = threading.Lock()
        self._pool_seen: tuple[float, tuple[int, int | None]] = (0.0, (0, None))
        self._views: dict[tuple[str, str], tuple[float, JobOut]] = {}
        self._handoff: queue.SimpleQueue[tuple[Job, threading.Event]] = queue.SimpleQueue()
        with store.session() as session:  # stored by a server that stopped before handing them off
            for job in session.scalars(sa.select(Job).where(Job.state == "QUEUED", Job.flow_run_id.is_(None))):
                self.hand_off_later(job)
        threading.Thread(target=self._hand_off_loop, name="job-handoff", daemon=True).start()

    # -- submit -------------------------------------------------------------------------------------------------

    def submit(self, tenant: str, request: JobSubmit) -> tuple[Job, bool]:
        """The job for this request and whether it is new (an idempotency key already used returns its job)."""
        existing = self._by_idempotency_key(tenant, request.idempotency_key)
        if existing is not None:
            return existing, False
        upload = self._upload(tenant, request.upload_id)
        job_id = f"job-{secrets.token_hex(6)}"
        params = self._spec(tenant, job_id, request.spec, upload)
        with self.store.session() as session:
            quotas = session.get(Tenant, tenant)
            self._check_quotas(quotas, params)
        problem, resolved = self.env_check.check(params, upload)
        if problem:
            raise Invalid(problem)
        try:
            params = merge_resolved(params, resolved)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        with self.store.session() as session:
            self._check_quotas(session.get(Tenant, tenant), params)  # the resolved budget, checked again
        with self._submit_lock, self.store.session() as session:
            existing = self._by_idempotency_key(tenant, request.idempotency_key, session)
            if existing is not None:
                return existing, False
            quotas = session.scalars(sa.select(Tenant).where(Tenant.name == tenant).with_for_update()).one()
            self._check_queued(session, quotas)
            job = Job(
                id=job_id,
                tenant=tenant,
                state="QUEUED",
                spec=params,
                priority=request.priority,
                idempotency_key=request.idempotency_key,
                upload_id=upload.id if upload else None,
            )
            session.add(job)
        return self._hand_off(job), True

    def _by_idempotency_key(self, tenant: str, key: str | None, session=None) -> Job | None:
        if key is None:
            return None
        query = sa.select(Job).where(Job.tenant == tenant, Job.idempotency_key == key)
        if session is not None:
            return session.scalars(query).first()
        with self.store.session() as session:
            return session.scalars(query).first()

    def _upload(self, tenant: str, upload_id: str | None) -> Upload | None:
        if upload_id is None:
            return None
        with self.store.session() as session:
            upload = session.get(Upload, upload_id)
            if upload is None or upload.tenant != tenant:
                raise Invalid(f"upload_id: no upload {upload_id!r} (upload the env code first: POST /v1/uploads)")
            return upload

    def _spec(self, tenant: str, job_id: str, spec: dict[str, Any], upload: Upload | None) -> RunSpec:
        """The request's spec as a ``RunSpec``, with the server's fields filled in."""
        for field, why in SERVER_FIELDS.items():
            if spec.get(field) not in (None, False):
                raise Invalid(f"spec.{field}: set by the server ({why})")
        try:
            params = load_spec(None, **{k: v for k, v in spec.items() if k not in (*SERVER_FIELDS, "resolved")})
        except ConfigError as exc:
            raise Invalid(str(exc)) from None
        package = top_package(params.env_id)
        if package is None:
            if params.algorithm not in ("grpo", "group"):  # shipped text tasks and group envs: the spec checked them
                _check_gymnasium_id(params.env_id)
        elif upload is None:
            raise Invalid(
                f"upload_id: env_id {params.env_id!r} is your own code: upload its package {package!r} first "
                "(the CLI and SDK do it for you)"
            )
        elif package not in upload.packages:
            raise Invalid(
                f"upload_id: upload {upload.id} holds {', '.join(upload.packages) or 'nothing importable'}, "
                f"not {package!r} (the top-level package of env_id)"
            )
        if params.algorithm == "grpo" and params.engine.cache_dir is None:  # the server's converted base models
            engine = params.engine.model_copy(update={"cache_dir": str(tenants.base_model_cache(self.settings))})
            params = params.model_copy(update={"engine": engine})
        return params.model_copy(
            update={
                "run_name": job_id,
                "experiment": tenants.experiment(tenant),
                "model_name": tenants.model_name(tenant, params.resolved_model_name),
                "resume": True,
            }
        )

    @staticmethod
    def _check_quotas(quotas: Tenant, spec: RunSpec) -> None:
        if quotas.max_steps_per_job is not None and spec.budget > quotas.max_steps_per_job:
            unit = "updates" if spec.algorithm == "grpo" else "steps"
            raise OverQuota(
                f"max_steps_per_job: {unit} {spec.budget} is over the tenant's limit of {quotas.max_steps_per_job}"
            )
        workers = getattr(spec.engine, "workers", None) or 0
        gpus = spec.num_gpus + workers * spec.rollout_num_gpus
        if quotas.max_gpus is not None and gpus > quotas.max_gpus:
            raise OverQuota(f"max_gpus: the job asks for {gpus:g} GPUs, over the tenant's limit of {quotas.max_gpus:g}")

    @staticmethod
    def _check_queued(session, quotas: Tenant) -> None:
        if quotas.max_queued_jobs is None:
            return
        queued = session.scalar(sa.select(sa.func.count()).where(Job.tenant == quotas.name, Job.state == "QUEUED"))
        if queued >= quotas.max_queued_jobs:
            raise OverQuota(
                f"max_queued_jobs: the tenant has {queued} jobs queued, its limit is {quotas.max_queued_jobs}"
            )

    def _hand_off(self, job: Job) -> Job:
        """Queue the stored job's flow run and wait for it, at most ``HANDOFF_WAIT_S``. Waiting keeps priorities:
        Prefect orders a tenant's runs only among those that exist, and a 2 s bound let a burst's hand-offs lag
        behind its submits (Prefect on SQLite took ~4.4 s per flow run with two jobs writing), so 353 pairs of a
        tenant's jobs started lower priority first in the 200-job bench. Past the bound (Prefect down or stalled)
        the answer carries the job without its flow run: it is stored and will be handed off."""
        made = threading.Event()
        self._handoff.put((job, made))
        made.wait(HANDOFF_WAIT_S)
        return job

    def hand_off_later(self, job: Job) -> None:
        """Queue the stored job's flow run without waiting (a crashed job's next attempt)."""
        self._handoff.put((job, threading.Event()))

    def _hand_off_loop(self) -> None:
        """Make the flow runs of stored jobs, in the order they were stored; one that fails (Prefect unreachable or
        overloaded) is tried again after a pause, before the next. Jobs a stopped server stored without a flow run
        are queued here when the server starts; a flow run is idempotent per job and attempt, so several servers
        handing off the same job make one."""
        while True:
            job, made = self._handoff.get()
            pause = 1.0
            while not self._hand_off_one(job):
                time.sleep(pause)
                pause = min(2 * pause, HANDOFF_RETRY_MAX_S)
            made.set()

    def _hand_off_one(self, job: Job) -> bool:
        try:
            enqueue(self.store, self.orchestrator, job)
            return True
        except Exception:
            logger.exception("job %s: Prefect did not take its flow run; trying again", job.id)
            return False

    def apply_quotas(self, tenant: str) -> None:
        """Carry a changed running-jobs quota to the tenant's work queue."""
        with self.store.session() as session:
            limit = session.get(Tenant, tenant).max_running_jobs
        self.orchestrator.ensure_queue(tenant, limit)

    # -- read ---------------------------------------------------------------------------------------------------

    def get(self, tenant: str, job_id: str) -> Job:
        with self.store.session() as session:
            job = session.get(Job, job_id)
            if job is None or job.tenant != tenant:
                raise NotFound(f"job {job_id!r} not found")
            return job

    def list(self, tenant: str, state: str | None = None, limit: int = 100) -> list[Job]:
        with self.store.session() as session:
            query = sa.select(Job).where(Job.tenant == tenant).order_by(Job.created_at.desc()).limit(limit)
            if state is not None:
                query = query.where(Job.state == state)
            return list(session.scalars(query))

    def view(self, job: Job) -> JobOut:
        """The job as the API shows it: queue position and what it waits for while queued, progress while running."""
        spec = job.spec
        return JobOut(
            id=job.id,
            state=job.state,
            env_id=spec.env_id,
            algorithm=spec.algorithm,
            steps=spec.budget or 0,
            priority=job.priority,
            attempts=job.attempts,
            model_name=spec.model_name,
            created_at=job.created_at,
            started_at=job.started_at,
            ended_at=job.ended_at,
            reason=job.reason,
            queue=self._queue_info(job) if job.state == "QUEUED" else None,
            progress=self._progress(job) if job.state == "RUNNING" else None,
            flow_run_id=job.flow_run_id,
            flow_run_url=self.orchestrator.flow_run_url(job.flow_run_id) if job.flow_run_id else None,
        )

    @staticmethod
    def _progress(job: Job) -> Progress:
        reported = job.progress or Progress(total=job.spec.budget or 0)
        phase = "training" if job.phase == "running" and reported.step else job.phase or "starting"
        return reported.model_copy(update={"phase": phase})

    def _queue_info(self, job: Job) -> QueueInfo:
        """Where the job stands among its tenant's queued jobs (Prefect's order: earliest scheduled time first), and
        what holds it back."""
        step = PRIORITY_STEP.total_seconds()
        with self.store.session() as session:
            rows = session.execute(
                sa.select(Job.id, Job.queued_at, Job.priority).where(Job.tenant == job.tenant, Job.state == "QUEUED")
            ).all()
            running = session.scalar(sa.select(sa.func.count()).where(Job.tenant == job.tenant, Job.state == "RUNNING"))
            limit = session.get(Tenant, job.tenant).max_running_jobs
            pool_running = session.scalar(sa.select(sa.func.count()).where(Job.state == "RUNNING"))
        order = sorted(rows, key=lambda row: (row.queued_at - row.priority * step, row.id))
        position = next((i for i, row in enumerate(order, 1) if row.id == job.id), len(order))
        return QueueInfo(
            position=position, queued=len(order), waiting_for=self._waiting_for(running, limit, pool_running)
        )

    def _waiting_for(self, running: int, limit: int | None, pool_running: int) -> str:
        if limit is not None and running >= limit:
            return f"a running slot: the tenant runs {running} of its {limit} jobs (max_running_jobs)"
        workers, pool_limit = self._pool()
        if workers == 0:
            return "a worker: none is online (start one with `opentinker server worker`)"
        if pool_limit is not None and pool_running >= pool_limit:
            return f"cluster capacity: {pool_running} of {pool_limit} jobs run in the pool"
        return "a worker to pick it up (workers look twice a second)"

    def _pool(self) -> tuple[int, int | None]:
        """(workers online, the pool's concurrency limit), read from Prefect at most every ``POOL_TTL_S``."""
        seen_at, figures = self._pool_seen
        if time.monotonic() - seen_at > POOL_TTL_S:
            figures = (self.orchestrator.workers_online(), self.orchestrator.pool_limit())
            self._pool_seen = (time.monotonic(), figures)
        return figures

    def fresh_view(self, tenant: str, job_id: str) -> JobOut | None:
        """The shared view of the tenant's job if it is younger than ``VIEW_TTL_S``, else None. It reads no database,
        so the event loop answers from it without a thread."""
        hit = self._views.get((tenant, job_id))
        return hit[1] if hit is not None and time.monotonic() - hit[0] < VIEW_TTL_S else None

    def cached_view(self, tenant: str, job_id: str) -> JobOut:
        """``view`` of the tenant's job, shared by every reader for ``VIEW_TTL_S``: fifty clients polling one job's
        status and following its events read it from the database a few times a second, not hundreds."""
        view = self.fresh_view(tenant, job_id)
        if view is not None:
            return view
        view = self.view(self.get(tenant, job_id))
        self._views[(tenant, job_id)] = (time.monotonic(), view)
        if len(self._views) > 10_000:
            self._views.clear()
        return view

    # -- act ----------------------------------------------------------------------------------------------------

    def cancel(self, tenant: str, job_id: str) -> Job:
        """Cancel a queued or running job: its process stops (and its Ray work with it); its checkpoints stay."""
        job = self.get(tenant, job_id)
        if job.state in FINAL_STATES:
            raise Conflict(f"job {job_id} is already {job.state}")
        with self.store.session() as session:
            row = session.get(Job, job_id)
            row.cancel_requested = True
            row.reason = "cancel requested"
            flow_run_id = row.flow_run_id
        if flow_run_id is not None:  # else the sync loop cancels the flow run the hand-off makes
            self.orchestrator.cancel(flow_run_id)
        return self.get(tenant, job_id)

    def resume(self, tenant: str, job_id: str) -> Job:
        """Queue a new attempt of a cancelled or failed job: it continues from the job's last checkpoint."""
        job = self.get(tenant, job_id)
        if job.state not in ("CANCELLED", "FAILED"):
            raise Conflict(f"job {job_id} is {job.state}: only a CANCELLED or FAILED job can be resumed")
        with self._submit_lock, self.store.session() as session:
            quotas = session.scalars(sa.select(Tenant).where(Tenant.name == tenant).with_for_update()).one()
            self._check_queued(session, quotas)
            row = session.get(Job, job_id)
            row.state, row.attempts, row.queued_at = "QUEUED", row.attempts + 1, time.time()
            row.cancel_requested, row.ended_at, row.reason, row.phase = False, None, "resumed", ""
            row.flow_run_id = None
        return self._hand_off(self.get(tenant, job_id))


def enqueue(store: Store, orchestrator: Orchestrator, job: Job) -> None:
    """The flow run of the job's current attempt, in its tenant's queue (limit = running-jobs quota)."""
    with store.session() as session:
        limit = session.get(Tenant, job.tenant).max_running_jobs
    orchestrator.ensure_queue(job.tenant, limit)
    flow_run_id = orchestrator.submit(job.id, job.attempts, job.tenant, job.priority, job.queued_at)
    with store.session() as session:
        session.get(Job, job.id).flow_run_id = flow_run_id
    job.flow_run_id = flow_run_id


def _check_gymnasium_id(env_id: str) -> None:
    from opentinker.envs.base import env_spec
    from opentinker.envs.errors import EnvSpecError

    try:
        env_spec(env_id)
    except EnvSpecError as exc:
        hint = str(exc.__cause__ or exc)
        raise Invalid(
            f"env_id: {env_id!r} is not a registered gymnasium id ({hint}; expected e.g. 'CartPole-v1', or your own "
            "env as 'package.module:Class' with its package uploaded)"
        ) from None
