"""Job specs: YAML files whose keys are the long option names of a command."""
