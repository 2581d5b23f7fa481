"""hsadmm — see DESIGN.md."""
