"""What a person sees of a run and a sweep: the console's progress lines and bars, experiment
tracking, the sweep's comparison report, and the model card pushed to the Hub."""
