"""What every ``opentinker train`` process loads before its flow runs, loaded once by the data dir's warm flow process
(``tasks.fork_server.FLOW``), which forks each later command instead of a fresh interpreter loading it again."""


def warm_up() -> None:
    """The terminal's quiet Prefect settings first (Prefect reads its logging settings as it is imported), then the
    flows, Prefect's engines, MLflow's stores and flavours, GitPython (MLflow's source tags) and MLflow's map of
    installed packages (read from every distribution's metadata: ~1 s). Nothing of a run: no store is opened."""
    import importlib

    from opentinker.tasks import prepare_prefect

    prepare_prefect()
    for name in (
        "opentinker.flows.train",
        "prefect.flow_engine",
        "prefect.task_engine",
        "mlflow.pyfunc",
        "mlflow.store.tracking.sqlalchemy_store",
        "mlflow.store.model_registry.sqlalchemy_store",
        "git",
    ):
        importlib.import_module(name)
    from mlflow.utils.requirements_utils import _init_packages_to_modules_map

    _init_packages_to_modules_map()
