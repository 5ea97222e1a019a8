"""autoprec.agents (see DESIGN.md)."""
