from poprun.cli.command import run

run()
