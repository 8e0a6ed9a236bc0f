"""Where cells run: device resolution, worker processes and clusters, health checks, explicit sends."""
