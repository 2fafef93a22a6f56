"""The inference controller: engine lifecycle, health, weight updates and offload, driven through Redis.

Kept import-free so ``rollout-bus controller`` (``controller.cli``) can parse its config before anything heavy loads.
"""
