"""Typed hyper-parameters for PPO, DQN, SAC, TD3 and GRPO (CleanRL style: one docstring per field)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from opentinker.envs.remote_env import BACKENDS
from opentinker.infra.checks import check_field, check_ints


@dataclass
class TrainerConfig:
    """Fields every trainer's config has: how its env copies are built (when given an env id), the network, the
    schedules' horizon and the torch threads while it trains."""

    num_envs: int = 8
    """Env copies stepped together (with a RemoteEnv: its ``num_envs``; a different value here is an error)."""
    workers: int | None = None
    """RemoteEnv workers (processes with the ray backend); None lets RemoteEnv choose."""
    backend: str = "auto"
    """RemoteEnv backend: "auto", "local" (in-process) or "ray" (one actor per worker)."""
    state_diff: bool = False
    """Send observations from workers delta-encoded and zstd-compressed (bit-exact)."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Widths of the MLP's hidden layers."""
    activation: str = "tanh"
    """Hidden-layer activation: "tanh" or "relu"."""
    total_steps: int | None = None
    """Horizon of the schedules (LR annealing, epsilon). None: the ``steps`` of the first ``train`` call."""
    num_learners: int = 1
    """Learner processes (Ray actors) sharing each update: every minibatch is split across them and their gradients
    are averaged with a ring all-reduce (torch.distributed: gloo on CPU, NCCL on CUDA). 1: in this process."""
    torch_threads: int | None = 1
    """Torch intra-op threads while ``train`` runs (restored after). Small MLPs are overhead-bound: extra
    threads only spin against the env loop and other processes. None keeps torch's setting."""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        check_field("num_envs", isinstance(self.num_envs, int) and self.num_envs >= 1, "an int >= 1", self.num_envs)
        check_field("workers", self.workers is None or self.workers >= 1, "None or an int >= 1", self.workers)
        check_field("backend", self.backend in BACKENDS, " or ".join(map(repr, BACKENDS)), self.backend)
        check_field(
            "num_learners",
            isinstance(self.num_learners, int) and self.num_learners >= 1,
            "an int >= 1",
            self.num_learners,
        )
        check_field("activation", self.activation in ("tanh", "relu"), '"tanh" or "relu"', self.activation)
        check_field(
            "hidden_sizes",
            all(isinstance(h, int) and h > 0 for h in self.hidden_sizes),
            "positive ints",
            self.hidden_sizes,
        )
        check_field("total_steps", self.total_steps is None or self.total_steps > 0, "None or > 0", self.total_steps)
        for name in (f.name for f in dataclasses.fields(self) if f.type == "float"):
            check_field(name, getattr(self, name) >= 0, ">= 0", getattr(self, name))


@dataclass
class PPOConfig(TrainerConfig):
    """Proximal Policy Optimisation (clipped objective, GAE), after CleanRL's ppo.py / ppo_continuous_action.py."""

    n_steps: int = 128
    """Steps each env copy runs per iteration; a batch is ``num_envs * n_steps`` transitions."""
    learning_rate: float = 2.5e-4
    """Adam learning rate (start value when annealed)."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over ``total_steps``."""
    gamma: float = 0.99
    """Discount factor."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before GAE (e.g. 0.1 on Pendulum keeps values near unit scale)."""
    gae_lambda: float = 0.95
    """GAE lambda: bias/variance trade-off of advantages."""
    num_minibatches: int = 4
    """Minibatches per epoch."""
    update_epochs: int = 4
    """Passes over each batch."""
    norm_adv: bool = True
    """Normalise advantages within each minibatch."""
    clip_coef: float = 0.2
    """Policy ratio clipping range."""
    clip_vloss: bool = True
    """Clip the value update to ``clip_coef`` around the old values."""
    ent_coef: float = 0.01
    """Entropy bonus weight."""
    vf_coef: float = 0.5
    """Value loss weight."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip."""
    target_kl: float | None = None
    """Stop the epoch loop early once the approximate KL exceeds this; None never stops."""
    norm_obs: bool = False
    """Normalise observations by running mean/variance (SB3 ``VecNormalize``); the statistics are buffers of the
    policy, so checkpoints, exports and serving apply the same normalisation."""
    norm_reward: bool = False
    """Scale rewards by the running std of the discounted return (SB3 ``VecNormalize``), before ``reward_scale``."""
    norm_clip: float = 10.0
    """Normalised observations and rewards are clipped to [-norm_clip, norm_clip]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field("n_steps", isinstance(self.n_steps, int) and self.n_steps >= 1, "an int >= 1", self.n_steps)
        check_field("num_minibatches", self.num_minibatches >= 1, "an int >= 1", self.num_minibatches)
        check_field("update_epochs", self.update_epochs >= 1, "an int >= 1", self.update_epochs)
        check_field("gamma", 0 <= self.gamma <= 1, "in [0, 1]", self.gamma)
        check_field("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]", self.gae_lambda)
        check_field("learning_rate", self.learning_rate > 0, "> 0", self.learning_rate)


@dataclass
class DQNConfig(TrainerConfig):
    """Deep Q-learning with a replay buffer and a target network, after CleanRL's dqn.py but with the Huber TD loss
    of Mnih et al. (2015) and SB3, which RL-Zoo's published DQN hyper-parameters (our presets) were tuned with."""

    num_envs: int = 4
    """Env copies stepped together."""
    activation: str = "relu"
    """Hidden-layer activation: "tanh" or "relu"."""
    n_steps: int = 32
    """Steps each env copy runs per iteration before the iteration's gradient steps."""
    learning_rate: float = 2.5e-4
    """Adam learning rate."""
    buffer_size: int = 10_000
    """Replay buffer capacity (transitions)."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 1.0
    """Target network update rate (1.0 = hard copy)."""
    target_network_frequency: int = 500
    """Env steps between target network updates."""
    batch_size: int = 128
    """Transitions per gradient step."""
    start_e: float = 1.0
    """Exploration epsilon at the start."""
    end_e: float = 0.05
    """Exploration epsilon after the decay."""
    exploration_fraction: float = 0.5
    """Share of ``total_steps`` over which epsilon decays linearly (when ``epsilon_decay`` is None)."""
    epsilon_decay: float | None = None
    """Multiplicative schedule instead of the linear one: after ``t`` steps of each env copy epsilon is
    ``max(end_e, start_e * epsilon_decay ** t)`` (e.g. 0.995). None: the linear schedule."""
    learning_starts: int = 10_000
    """Env steps collected before learning begins."""
    train_frequency: int = 10
    """Env steps per gradient step."""
    max_grad_norm: float = 10.0
    """Global gradient-norm clip."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field("n_steps", isinstance(self.n_steps, int) and self.n_steps >= 1, "an int >= 1", self.n_steps)
        check_field(
            "buffer_size", self.buffer_size >= self.batch_size, f">= batch_size ({self.batch_size})", self.buffer_size
        )
        check_field("train_frequency", self.train_frequency >= 1, "an int >= 1", self.train_frequency)
        check_field("tau", 0 < self.tau <= 1, "in (0, 1]", self.tau)
        check_field(
            "epsilon_decay",
            self.epsilon_decay is None or 0 < self.epsilon_decay <= 1,
            "in (0, 1] or None (linear schedule)",
            self.epsilon_decay,
        )
        check_field("learning_rate", self.learning_rate > 0, "> 0", self.learning_rate)


@dataclass
class OffPolicyConfig(TrainerConfig):
    """What SAC and TD3 share: a replay buffer fed by env copies acting with the current actor, twin Q critics with
    Polyak-averaged targets, uniform random actions until ``learning_starts``. Defaults are SB3's (batch 256, buffer
    1M, tau 0.005, one gradient step per env step, 256x256 ReLU) with CleanRL's 5k-step warm-up."""

    num_envs: int = 1
    """Env copies stepped together (RL-Zoo's MuJoCo settings step one)."""
    hidden_sizes: tuple[int, ...] = (256, 256)
    """Widths of the hidden layers of the actor and of each critic."""
    activation: str = "relu"
    """Hidden-layer activation: "tanh" or "relu"."""
    n_steps: int = 1
    """Steps each env copy runs per iteration before the iteration's gradient steps (SB3's ``train_freq``)."""
    learning_rate: float = 3e-4
    """Adam learning rate of the actor and the critics (and of SAC's temperature)."""
    buffer_size: int = 1_000_000
    """Replay buffer capacity (transitions)."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 0.005
    """Target smoothing: target <- tau * online + (1 - tau) * target after every critic step."""
    batch_size: int = 256
    """Transitions per gradient step."""
    learning_starts: int = 5_000
    """Env steps of uniform random actions collected before learning begins."""
    train_frequency: int = 1
    """Env steps per gradient step; an iteration's gradient steps run after its env steps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field("n_steps", isinstance(self.n_steps, int) and self.n_steps >= 1, "an int >= 1", self.n_steps)
        check_field(
            "batch_size", isinstance(self.batch_size, int) and self.batch_size >= 1, "an int >= 1", self.batch_size
        )
        check_field(
            "buffer_size", self.buffer_size >= self.batch_size, f">= batch_size ({self.batch_size})", self.buffer_size
        )
        check_field("train_frequency", self.train_frequency >= 1, "an int >= 1", self.train_frequency)
        check_field("tau", 0 < self.tau <= 1, "in (0, 1]", self.tau)
        check_field("gamma", 0 <= self.gamma <= 1, "in [0, 1]", self.gamma)
        check_field("learning_rate", self.learning_rate > 0, "> 0", self.learning_rate)


@dataclass
class SACConfig(OffPolicyConfig):
    """Soft Actor-Critic (Haarnoja et al. 2018, with the automatic temperature of the 2018 follow-up), after CleanRL's
    sac_continuous_action.py: a squashed-Gaussian actor, twin critics and their targets, a learned temperature."""

    alpha: float | None = None
    """Entropy temperature; None learns it (``log_alpha`` by Adam) so the policy's entropy tracks ``target_entropy``."""
    target_entropy: float | None = None
    """Entropy the learned temperature aims at; None: minus the number of action dimensions (the paper's choice)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field("alpha", self.alpha is None or self.alpha > 0, "None (learned) or > 0", self.alpha)


@dataclass
class TD3Config(OffPolicyConfig):
    """Twin Delayed DDPG (Fujimoto et al. 2018), after CleanRL's td3_continuous_action.py: a deterministic tanh actor,
    clipped double-Q targets with target policy smoothing, actor and target updates every ``policy_delay`` steps."""

    learning_rate: float = 1e-3
    """Adam learning rate of the actor and the critics (the paper's, and SB3's)."""
    exploration_noise: float = 0.1
    """Std of the Gaussian noise added to the actor's actions while collecting (in units of half the action range)."""
    policy_noise: float = 0.2
    """Std of the target policy smoothing noise added to the target actor's actions (same units)."""
    noise_clip: float = 0.5
    """Target policy smoothing noise is clipped to [-noise_clip, noise_clip]."""
    policy_delay: int = 2
    """Critic steps per actor step (and per target update)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(
            "policy_delay",
            isinstance(self.policy_delay, int) and self.policy_delay >= 1,
            "an int >= 1",
            self.policy_delay,
        )


@dataclass
class GRPOConfig:
    """Everything one GRPO run needs besides the seed (CleanRL style: one flat, typed config)."""

    task: str = "arithmetic"
    """The text env: a shipped task (``envs.text_tasks.TEXT_TASKS``) or ``module:factory`` (``make_text_env``)."""
    base_model: str = "smollm2"
    """``"smollm2"``, ``"tiny"`` or a transformers checkpoint folder (``agents.lm_policy``)."""
    group_size: int = 8
    """Completions per prompt; the group's rewards are each other's baseline."""
    prompts_per_step: int = 4
    """Train prompts drawn per update (without replacement, epoch after epoch)."""
    max_new_tokens: int = 24
    """Per reply (per turn)."""
    temperature: float = 0.7
    """SmolLM2-135M at 1.0 rambles (~0% exact answers on ``arithmetic``, no signal); 0.7 gives ~15%."""
    learning_rate: float = 5e-4
    """AdamW (no weight decay), adapter parameters only."""
    clip_range: float = 0.2
    """PPO-style ratio clipping range of the surrogate."""
    kl_coef: float = 0.0
    """beta: weight of the KL penalty towards the base model (0, as in DAPO and TRL's default, skips its pass)."""
    loss_norm: Literal["token", "sequence"] = "token"
    """How tokens are averaged: over the whole batch ("token", DAPO) or within each completion first ("sequence")."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (Dr. GRPO argues for False)."""
    update_epochs: int = 1
    """Optimiser passes over each batch; with 1 the ratio is 1 and clipping never binds."""
    micro_batch: int = 8
    """Completions per forward/backward (gradients accumulate: memory, not maths)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip of the adapter's parameters."""
    lora_rank: int = 16
    """Rank of the LoRA adapter (the only weights trained)."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``)."""
    task_seed: int = 0
    """Generates the task's examples and its train / held-out split."""
    eval_prompts: int = 64
    """Held-out prompts evaluated (greedy), the first ones of the split."""
    eval_batch: int = 16
    """Held-out episodes played together (one batched ``generate`` per turn)."""
    cache_dir: str | None = None
    """Where the de-quantised base model is cached (default ``<data_dir>/llm-cache``)."""

    def __post_init__(self) -> None:
        counts = ("prompts_per_step", "max_new_tokens", "update_epochs", "micro_batch", "lora_rank", "lora_alpha")
        check_ints(self, (*counts, "eval_prompts", "eval_batch"), prefix="GRPOConfig.")
        check_ints(self, ("group_size",), minimum=2, prefix="GRPOConfig.")  # a group is its own baseline
        for name in ("temperature", "kl_coef", "learning_rate", "clip_range", "max_grad_norm"):
            value = getattr(self, name)
            check_field(f"GRPOConfig.{name}", isinstance(value, (int, float)) and value >= 0, "a number >= 0", value)
        check_field(
            "GRPOConfig.temperature", self.temperature > 0, "> 0 (greedy completions are all alike)", self.temperature
        )
        check_field(
            "GRPOConfig.loss_norm", self.loss_norm in ("token", "sequence"), "'token' or 'sequence'", self.loss_norm
        )
        check_field("GRPOConfig.lora_rank", self.lora_rank <= 512, "<= 512 (AdapterShape's limit)", self.lora_rank)

    @property
    def lora(self):
        """The adapter's ``AdapterShape``: attention and MLP projections (not the output layer)."""
        from opentinker.agents.multi_lora import AdapterShape

        return AdapterShape(rank=self.lora_rank, alpha=self.lora_alpha, train_unembed=False)


CONFIGS: dict[str, type[TrainerConfig]] = {"ppo": PPOConfig, "dqn": DQNConfig, "sac": SACConfig, "td3": TD3Config}
"""Algorithm name -> its config class; each is a member of the run spec's ``RunSpec.engine`` union
(``tasks/spec.py``)."""
ENV_FIELDS = ("num_envs", "workers", "backend", "state_diff")
"""``TrainerConfig`` fields that say how env copies are built (a pipeline config file sets them at the top level)."""


def check_fields(algorithm: str, names: Iterable[str]) -> None:
    """Every name is a field of ``algorithm``'s config; else the error names the field and why: another
    algorithm's field does not apply to this one, anything else is unknown."""
    config_cls = CONFIGS[algorithm]
    known = {field.name for field in dataclasses.fields(config_cls)}
    for name in names:
        if name in known:
            continue
        owners = [other for other, cls in CONFIGS.items() if name in {f.name for f in dataclasses.fields(cls)}]
        if owners:
            raise ValueError(
                f"{name!r} does not apply to algorithm {algorithm!r} (a {CONFIGS[owners[0]].__name__} field: "
                f"set algorithm = {owners[0]!r} to use it)"
            )
        raise ValueError(f"unknown {config_cls.__name__} field {name!r}; expected one of: {', '.join(sorted(known))}")
