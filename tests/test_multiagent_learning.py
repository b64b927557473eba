"""Both kinds learn on pursuit: PPO predators catch more prey, DQN prey survive longer (short CPU runs)."""

import numpy as np

from opentinker.agents.multiagent import AgentGroup

PREDATOR = {"lr": 3e-3, "gamma": 0.95, "update_epochs": 8, "num_minibatches": 2, "ent_coef": 0.003}
PREY = {
    "lr": 1e-3,
    "gamma": 0.95,
    "learning_starts": 500,
    "train_frequency": 8,
    "target_network_frequency": 500,
    "buffer_size": 20_000,
    "batch_size": 64,
    "exploration_fraction": 0.3,
}


def curve(trainer, steps, metric):
    values = []
    trainer.train(steps, callback=lambda m, s: values.append(m[metric]) if metric in m else None)
    return np.array(values)


def test_predators_capture_rate_rises_against_frozen_prey():
    group = AgentGroup({"predator": "PPO", "prey": "DQN"}).configure(predator=PREDATOR, prey=PREY)
    trainer = group.build(
        "pursuit",
        num_envs=8,
        n_steps=32,
        seed=0,
        device="cpu",
        n_predators=2,
        n_prey=2,
        grid_size=8,
        capture_radius=0,
        max_cycles=30,
    )
    trainer.freeze("prey")  # prey act at random (frozen DQN at epsilon 1): a fixed target to learn against
    capture = curve(trainer, 6_144, "prey/charts/terminated_fraction")
    first, last = capture[:4].mean(), capture[-4:].mean()
    assert last >= first + 0.15 and last >= 0.85, (first, last, capture.round(2).tolist())
    assert trainer.trainers["prey"].global_step == 0


def test_prey_survival_time_rises_when_predators_are_frozen():
    group = AgentGroup({"predator": "PPO", "prey": "DQN"}).configure(predator=PREDATOR, prey=PREY)
    trainer = group.build(
        "pursuit",
        num_envs=8,
        n_steps=32,
        seed=0,
        device="cpu",
        n_predators=3,
        n_prey=3,
        grid_size=8,
        capture_radius=1,
        max_cycles=40,
    )
    trainer.freeze("predator")
    survival = curve(trainer, 4_608, "prey/charts/episodic_length")
    first, last = survival[:4].mean(), survival[-4:].mean()
    assert last >= 1.5 * first, (first, last, survival.round(1).tolist())
    assert trainer.trainers["predator"].global_step == 0
