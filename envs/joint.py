"""Joint stepping: ``num_envs`` copies of a PettingZoo parallel env, every agent acting each step, split by kind.

Each kind gets fixed columns (env copy x agent of that kind) so its data has the RL core's ``Rollout`` layout
(time x columns) and the RL core's PPO/DQN updates run on it unchanged. Columns follow the RL core's NEXT_STEP
convention: a column is ``valid`` only while its agent is alive; an agent that leaves keeps its final
observation in later rows (what truncation bootstraps need); when an env copy has no agents left, the next
step only resets it (``valid`` False everywhere in that copy).

Shared memory (off by default): every agent also reads the previous step's *mean observation* of each kind
(mode "all") or of its own kind (mode "kind") among the living agents of its env copy — a blackboard each
agent writes its observation to and reads one step later. Zeros after a reset.

Everything random is per env copy: copy ``e`` resets with seed (seed, e) and draws its actions from a Generator
seeded by (seed, iteration, e), with the policy evaluated on that copy's rows only. So a rollout does not
depend on how the copies are split: shards (``collect_shard``) joined by ``join`` in env-copy order give the same
data, bit for bit, as one shard. Where the shards run is ``envs/multiagent.py``'s business.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np
from pettingzoo import ParallelEnv

from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.rollout import Rollout, derive_seed

# Per-kind arrays of JointEnvs with the env copy on axis 0 (what split/merge cut and join).
_PER_COPY = ("obs", "alive", "ep_return", "ep_len", "channel")


class JointEnvs:
    """Env copies with fixed agent columns per kind, NEXT_STEP resets, episode bookkeeping and shared memory.

    ``first`` is the global index of the first copy (a shard of a larger set): it seeds resets and noise.
    """

    def __init__(
        self,
        make: Callable[[], ParallelEnv],
        num_envs: int,
        kind_of: Callable[[str], str],
        kinds: list[str],
        shared_memory: str | None,
        seed: int,
        first: int = 0,
    ):
        self.first = first
        self.envs = [make() for _ in range(num_envs)]
        for env in self.envs:
            if not isinstance(env, ParallelEnv):
                raise ValueError(f"the env factory built {type(env).__name__}, not a PettingZoo ParallelEnv")
        first = self.envs[0]
        self.agents = {k: [a for a in first.possible_agents if kind_of(a) == k] for k in kinds}
        empty = [k for k, ids in self.agents.items() if not ids]
        if empty:
            raise ValueError(
                f"kind(s) {empty} of policy_mapping match no agent of the env {list(first.possible_agents)}"
            )
        self.raw_spaces: dict[str, gym.Space] = {}
        for kind, ids in self.agents.items():
            spaces = {(str(first.observation_space(a)), str(first.action_space(a))) for a in ids}
            if len(spaces) > 1:
                raise ValueError(
                    f"agents of kind {kind!r} have different observation/action spaces {sorted(spaces)}; "
                    "parameter sharing needs one space per kind: split them into kinds"
                )
            self.raw_spaces[kind] = first.observation_space(ids[0])
        self.action_spaces = {k: first.action_space(ids[0]) for k, ids in self.agents.items()}
        self.kinds, self.shared_memory, self.num_envs = kinds, shared_memory, num_envs
        self.observation_spaces = {k: self._space_with_memory(k) for k in kinds}
        self.finished: dict[str, list[tuple[int, float, int, bool]]] = {k: [] for k in kinds}
        self.obs = {
            k: np.zeros((num_envs, len(ids), *self.raw_spaces[k].shape), self.raw_spaces[k].dtype)
            for k, ids in self.agents.items()
        }
        self.alive = {k: np.zeros((num_envs, len(ids)), bool) for k, ids in self.agents.items()}
        self.ep_return = {k: np.zeros((num_envs, len(ids))) for k, ids in self.agents.items()}
        self.ep_len = {k: np.zeros((num_envs, len(ids)), np.int64) for k, ids in self.agents.items()}
        self.channel = {k: np.zeros((num_envs, self._flat_dim(k)), np.float32) for k in kinds}
        self.resetting = np.ones(num_envs, bool)
        self.episodes_done = np.zeros(num_envs, np.int64)
        for e in range(num_envs):
            self._reset(e, seed=derive_seed(seed, self.first + e))

    # -- shards --------------------------------------------------------------------------------------------------
    def split(self, sizes: list[int]) -> list[JointEnvs]:
        """Consecutive shards of ``sizes`` copies each (state included), in env-copy order."""
        if sum(sizes) != self.num_envs:
            raise ValueError(f"JointEnvs.split: sizes {sizes} do not add up to num_envs={self.num_envs}")
        bounds = np.cumsum([0, *sizes])
        parts = []
        for a, b in itertools.pairwise(bounds):
            part = copy.copy(self)
            part.envs, part.num_envs, part.first = self.envs[a:b], int(b - a), self.first + int(a)
            for name in _PER_COPY:
                setattr(part, name, {k: v[a:b].copy() for k, v in getattr(self, name).items()})
            part.resetting, part.episodes_done = self.resetting[a:b].copy(), self.episodes_done[a:b].copy()
            part.finished = {k: [(e - a, *rest) for e, *rest in v if a <= e < b] for k, v in self.finished.items()}
            parts.append(part)
        return parts

    @staticmethod
    def merge(parts: list[JointEnvs]) -> JointEnvs:
        """The inverse of ``split``: one JointEnvs holding every shard's copies, in order."""
        whole = copy.copy(parts[0])
        whole.envs = [env for p in parts for env in p.envs]
        whole.num_envs = sum(p.num_envs for p in parts)
        for name in _PER_COPY:
            setattr(whole, name, {k: np.concatenate([getattr(p, name)[k] for p in parts]) for k in whole.kinds})
        whole.resetting = np.concatenate([p.resetting for p in parts])
        whole.episodes_done = np.concatenate([p.episodes_done for p in parts])
        offsets = np.cumsum([0, *[p.num_envs for p in parts]])
        whole.finished = {
            k: [(e + o, *rest) for p, o in zip(parts, offsets) for e, *rest in p.finished[k]] for k in whole.kinds
        }
        return whole

    # -- spaces and observations -----------------------------------------------------------------------------
    def _flat_dim(self, kind: str) -> int:
        return int(np.prod(self.raw_spaces[kind].shape))

    def _readers(self, kind: str) -> list[str]:
        """Kinds whose channel ``kind``'s agents read."""
        return {None: [], "all": self.kinds, "kind": [kind]}[self.shared_memory]

    def _space_with_memory(self, kind: str) -> gym.Space:
        space = self.raw_spaces[kind]
        if not self.shared_memory:
            return space
        for k in self._readers(kind):
            if not isinstance(self.raw_spaces[k], gym.spaces.Box):
                raise ValueError(f"shared_memory needs Box observations; kind {k!r} observes {self.raw_spaces[k]}")
        lows = [space.low.reshape(-1)] + [self.raw_spaces[k].low.reshape(-1) for k in self._readers(kind)]
        highs = [space.high.reshape(-1)] + [self.raw_spaces[k].high.reshape(-1) for k in self._readers(kind)]
        return gym.spaces.Box(
            np.concatenate(lows).astype(np.float32), np.concatenate(highs).astype(np.float32), dtype=np.float32
        )

    def observations(self, kind: str) -> np.ndarray:
        """(num_envs * agents of kind, obs...) — what the kind's policy sees now, channel appended."""
        raw = self.obs[kind].reshape(-1, *self.raw_spaces[kind].shape)
        if not self.shared_memory:
            return raw
        n = len(self.agents[kind])
        memory = [np.repeat(self.channel[k], n, axis=0) for k in self._readers(kind)]
        return np.concatenate([raw.reshape(len(raw), -1).astype(np.float32), *memory], axis=1)

    # -- stepping -----------------------------------------------------------------------------------------------
    def _reset(self, e: int, seed: int | None = None) -> None:
        obs, _ = self.envs[e].reset(seed=seed)
        for kind, ids in self.agents.items():
            for j, agent in enumerate(ids):
                if agent in obs:
                    self.obs[kind][e, j] = obs[agent]
            self.alive[kind][e] = [a in self.envs[e].agents for a in ids]
            self.channel[kind][e] = 0.0
        self.resetting[e] = False

    def step(self, actions: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, ...]]:
        """Apply one action per column; per kind (rewards, terminated, truncated, valid), each (num_envs, n)."""
        valid = {k: self.alive[k] & ~self.resetting[:, None] for k in self.kinds}
        if self.shared_memory:
            for k in self.kinds:
                flat = self.obs[k].reshape(self.num_envs, len(self.agents[k]), -1).astype(np.float32)
                count = valid[k].sum(axis=1, keepdims=True)
                self.channel[k] = (flat * valid[k][..., None]).sum(axis=1) / np.maximum(count, 1)
        out = {
            k: (np.zeros(v.shape, np.float32), np.zeros(v.shape, bool), np.zeros(v.shape, bool), v)
            for k, v in valid.items()
        }
        for e, env in enumerate(self.envs):
            if self.resetting[e]:
                self._reset(e)
                continue
            act = {}
            for kind, ids in self.agents.items():
                acts = actions[kind].reshape(self.num_envs, len(ids), *actions[kind].shape[1:])[e]
                act.update({a: acts[j] for j, a in enumerate(ids) if valid[kind][e, j]})
            obs, rew, term, trunc, _ = env.step(act)
            remaining = set(env.agents)
            for kind, ids in self.agents.items():
                r, te, tr, v = out[kind]
                for j, agent in enumerate(ids):
                    if agent in obs:
                        self.obs[kind][e, j] = obs[agent]
                    if not v[e, j]:
                        continue
                    r[e, j] = rew.get(agent, 0.0)
                    te[e, j] = bool(term.get(agent, False))
                    # An agent that vanished without a flag ends its episode by truncation (no value leak).
                    tr[e, j] = bool(trunc.get(agent, False)) or (agent not in remaining and not te[e, j])
                self.alive[kind][e] = [a in remaining for a in ids]
            self.resetting[e] = not remaining
            if self.resetting[e]:
                self.episodes_done[e] += 1
        for kind, (r, te, tr, v) in out.items():
            self.ep_return[kind] += np.where(v, r, 0.0)
            self.ep_len[kind] += v
            for e, j in zip(*np.nonzero(te | tr)):
                self.finished[kind].append(
                    (int(e), float(self.ep_return[kind][e, j]), int(self.ep_len[kind][e, j]), bool(te[e, j]))
                )
                self.ep_return[kind][e, j], self.ep_len[kind][e, j] = 0.0, 0
        return out

    def take_finished(self, kind: str) -> list[tuple[int, float, int, bool]]:
        """(env copy, return, length, terminated) of the kind's agent episodes that ended since the last call."""
        done, self.finished[kind] = self.finished[kind], []
        return done


@dataclasses.dataclass
class Shard:
    """One worker's part of a joint rollout: per kind its columns' ``Rollout`` (episode fields left empty) and
    the agent-episodes that ended, as (step, global env copy, return, length, terminated)."""

    rollouts: dict[str, Rollout]
    ended: dict[str, list[tuple[int, int, float, int, bool]]]


def collect_shard(joint: JointEnvs, policies: dict[str, NumpyPolicy], n_steps: int, seed: int, iteration: int) -> Shard:
    """``n_steps`` joint steps of these copies; copy ``e`` draws its noise from (seed, iteration, e)."""
    start = time.perf_counter()
    rngs = [np.random.default_rng([seed, iteration, joint.first + e]) for e in range(joint.num_envs)]
    buf: dict[str, dict[str, np.ndarray]] = {k: {} for k in policies}
    ended: dict[str, list[tuple[int, int, float, int, bool]]] = {k: [] for k in policies}

    def store(kind: str, name: str, t: int, value: np.ndarray) -> None:
        if name not in buf[kind]:
            buf[kind][name] = np.zeros((n_steps, *value.shape), value.dtype)
        buf[kind][name][t] = value

    def rows(kind: str, x: np.ndarray, e: int) -> np.ndarray:
        """Env copy ``e``'s rows of a kind's batch (its agents' columns)."""
        n = len(joint.agents[kind])
        return x[e * n : (e + 1) * n]

    env_s = policy_s = 0.0
    for t in range(n_steps):
        t0 = time.perf_counter()
        env_actions = {}
        for kind, policy in policies.items():
            x = joint.observations(kind)
            samples = [policy.sample(rows(kind, x, e), rngs[e]) for e in range(joint.num_envs)]
            action, logp, value = (np.concatenate(a) for a in zip(*samples))
            for name, array in (("obs", x), ("actions", action), ("logprobs", logp), ("values", value)):
                store(kind, name, t, array)
            env_actions[kind] = policy.env_actions(action)
        t1 = time.perf_counter()
        results = joint.step(env_actions)
        env_s += time.perf_counter() - t1
        policy_s += t1 - t0
        for kind, arrays in results.items():
            for name, array in zip(("rewards", "terminated", "truncated", "valid"), arrays):
                store(kind, name, t, array.reshape(-1))
            ended[kind] += [(t, joint.first + e, r, n, d) for e, r, n, d in joint.take_finished(kind)]
    wall = time.perf_counter() - start
    rollouts = {}
    for kind, policy in policies.items():
        last_obs = joint.observations(kind)
        rollouts[kind] = Rollout(
            **buf[kind],
            last_obs=last_obs.copy(),
            last_values=np.concatenate([policy.values(rows(kind, last_obs, e)) for e in range(joint.num_envs)]),
            episode_returns=np.zeros(0),
            episode_lengths=np.zeros(0, np.int64),
            env_step_s=env_s,
            policy_s=policy_s,
            worker_wall_s=wall,
            wall_s=wall,
        )
    return Shard(rollouts, ended)


def join(shards: list[Shard]) -> tuple[dict[str, Rollout], dict[str, float]]:
    """Shards in env-copy order -> one ``Rollout`` per kind (columns = env copies x agents of the kind)
    and the share of each kind's ended agent-episodes that ended by termination (pursuit prey: capture rate).
    Ended episodes are listed by (step, env copy), as one shard would list them."""
    rollouts, terminated_fraction = {}, {}
    for kind in shards[0].rollouts:
        ended = sorted((e for s in shards for e in s.ended[kind]), key=lambda row: row[:2])
        rollouts[kind] = dataclasses.replace(
            Rollout.concat([s.rollouts[kind] for s in shards]),
            episode_returns=np.array([r for _, _, r, _, _ in ended], np.float64),
            episode_lengths=np.array([n for _, _, _, n, _ in ended], np.int64),
        )
        terminated_fraction[kind] = float(np.mean([d for *_, d in ended])) if ended else float("nan")
    return rollouts, terminated_fraction


def run_episodes(
    joint: JointEnvs, policies: dict[str, NumpyPolicy], max_steps: int = 100_000
) -> dict[str, list[tuple[float, int, bool]]]:
    """Deterministic actions until every env copy has finished one episode; per kind (return, length, terminated)."""
    for kind in policies:
        joint.take_finished(kind)
    results: dict[str, list[tuple[float, int, bool]]] = {k: [] for k in policies}
    first_episode = joint.episodes_done.copy()
    for _ in range(max_steps):
        if (joint.episodes_done > first_episode).all():
            return results
        actions = {
            k: p.env_actions(p.sample(joint.observations(k), None, deterministic=True)[0]) for k, p in policies.items()
        }
        still_first = joint.episodes_done == first_episode
        joint.step(actions)
        for kind in policies:
            results[kind] += [(r, n, t) for e, r, n, t in joint.take_finished(kind) if still_first[e]]
    raise RuntimeError(f"evaluation: an env copy ran {max_steps} steps without ending its episode (no time limit?)")
