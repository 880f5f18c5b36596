from actstore.cli import main

main(prog_name="actstore")
