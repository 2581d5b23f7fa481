"""dataparallel — see DESIGN.md."""
