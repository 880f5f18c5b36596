"""A pass or a layer in the forms other tools read: Neuronpedia / SAEDashboard JSON and delphi's latent cache."""
