"""autoprec.envs (see DESIGN.md)."""
