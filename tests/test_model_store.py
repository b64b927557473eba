"""The MLflow model format: log, register, alias, resolve and load policies (real MLflow store on SQLite)."""

from __future__ import annotations

import numpy as np
import pytest

from opentinker.tracking import registry as model_store
from opentinker.tracking.registry import PolicyStoreError


def _random_obs(policy, n: int, seed: int = 0) -> np.ndarray:
    space = policy.observation_space
    low, high = np.maximum(space.low, -3.0), np.minimum(space.high, 3.0)
    return np.random.default_rng(seed).uniform(low, high, size=(n, *space.shape)).astype(space.dtype)


def test_registry_uris_load_the_exact_registered_policy(registered_policies):
    name = registered_policies.name
    obs = _random_obs(registered_policies.policy("1"), 64)
    expected = {v: registered_policies.policy(v).act(obs) for v in ("1", "2")}
    assert not np.array_equal(expected["1"], expected["2"]), "versions must differ for this test to mean anything"

    for uri, version in ((f"models:/{name}/1", "1"), (f"models:/{name}/2", "2"), (f"models:/{name}@champion", "1")):
        ref, policy = model_store.load_policy_version(uri)
        assert (ref.name, ref.version) == (name, version)
        assert ref.run_id == registered_policies.run_ids[version]
        np.testing.assert_array_equal(policy.act(obs), expected[version])
    run_uri = f"runs:/{registered_policies.run_ids['2']}/policy"
    np.testing.assert_array_equal(model_store.load_registered_policy(run_uri).act(obs), expected["2"])


def test_alias_resolves_to_a_pinned_version(registered_policies):
    name = registered_policies.name
    assert model_store.resolve_policy(f"models:/{name}@champion").download_uri == f"models:/{name}/1"
    model_store.set_alias(name, "staging", "2")
    ref = model_store.resolve_policy(f"models:/{name}@staging")
    assert (ref.version, ref.alias, ref.download_uri) == ("2", "staging", f"models:/{name}/2")
    assert model_store.resolve_policy(f"models:/{name}/latest").version == max(registered_policies.exports, key=int)


def test_local_export_dir_is_accepted_and_versioned_by_content(registered_policies, tmp_path):
    import shutil

    source = registered_policies.exports["1"]
    copy = shutil.copytree(source, tmp_path / "copy")
    ref = model_store.resolve_policy(copy)
    assert ref.version.startswith("local-") and ref.version == model_store.resolve_policy(source).version
    obs = _random_obs(registered_policies.policy("1"), 16)
    np.testing.assert_array_equal(
        model_store.load_registered_policy(copy).act(obs), registered_policies.policy("1").act(obs)
    )
    shutil.copy(registered_policies.exports["2"] / "weights.npz", copy / "weights.npz")
    assert model_store.resolve_policy(copy).version != ref.version, "new weights, new version"


def test_pyfunc_flavour_predicts_like_the_policy_and_carries_a_signature(registered_policies):
    import mlflow

    model = mlflow.pyfunc.load_model(f"models:/{registered_policies.name}/2")
    inputs = model.metadata.get_input_schema().inputs[0]
    assert inputs.shape == (-1, 4) and inputs.type == np.dtype(np.float32)
    assert model.metadata.metadata["opentinker_policy"]["env_id"] == "CartPole-v1"
    example = np.asarray(model.input_example)
    assert example.shape == (1, 4) and example.dtype == np.float32  # shown in the MLflow UI next to the schema
    obs = _random_obs(registered_policies.policy("2"), 32, seed=3)
    np.testing.assert_array_equal(np.asarray(model.predict(obs)), registered_policies.policy("2").act(obs))


@pytest.mark.parametrize(
    "uri, message",
    [
        ("models:/no-such-model@champion", "cannot resolve"),
        ("models:/a/b/c", "expected models:/NAME@ALIAS"),
        ("/no/such/export", "export directory"),
    ],
)
def test_bad_uris_name_what_was_expected(registered_policies, uri, message):
    with pytest.raises(PolicyStoreError, match=message):
        model_store.load_registered_policy(uri)


def test_logging_a_non_export_is_refused(tmp_path):
    with pytest.raises(PolicyStoreError, match="export_dir"):
        model_store.log_policy_model(tmp_path)
