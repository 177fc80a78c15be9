"""The learner group: torchrun ranks with FSDP2, off-policy-corrected losses, weight broadcast."""
