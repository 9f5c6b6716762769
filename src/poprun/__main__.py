from poprun_entry import run

run()
