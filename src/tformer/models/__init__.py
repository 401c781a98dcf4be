"""One file per family: a Config dataclass and the nn.Module."""
