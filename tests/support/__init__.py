"""Helpers the tests share: models, spawned ranks, reference optimizers, fault injection."""
