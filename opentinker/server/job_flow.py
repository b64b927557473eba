"""The flow a server job runs: the project's own ``train_flow``, with Prefect flow retries.

A job that fails inside its flow run (a killed training process, a lost Ray worker beyond Ray's own retries) is
retried by Prefect in the same flow run; the job's spec always says ``resume=True`` and names the job's own run
directory, so a retry continues from the last checkpoint (bit-exact, as any resume) instead of starting over. The
deployment points at this module (``ENTRYPOINT``); it imports nothing of the server.
"""

from opentinker.flows.train import train_flow

RETRIES = 2
"""Flow retries per attempt of a job (a crashed flow-run process is re-queued by the server instead)."""

train_job = train_flow.with_options(retries=RETRIES, retry_delay_seconds=1)
