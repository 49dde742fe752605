from datapipe.cli import run

run()
