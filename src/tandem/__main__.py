from tandem.cli import entry

entry()
