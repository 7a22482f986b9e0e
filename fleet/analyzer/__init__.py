"""`fleet analyze`: Triton's Model Analyzer built in (sweep.py: the plan and the choice, pure; load.py: the
load; report.py: table, chart, plot; run.py: the command; its arguments: fleet/client_args.py)."""
