"""What the user hands in and how it is cut into cells: layer sequences, Functional graphs, cells."""
