"""The layers the models are composed of: each a small class with typed weights, built once
from the loaded checkpoint, whose forward calls the kernel API (`ops.*`) only."""
