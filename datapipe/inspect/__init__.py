"""What a run kept and dropped and why: statistics tables, pictures and the HTML page, and training-run plots."""
