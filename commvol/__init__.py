"""commvol — see DESIGN.md."""
