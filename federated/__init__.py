"""Federated training of RL policies through Flower (Message API): sites share weights, never data."""
