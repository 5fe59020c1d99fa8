"""The repository as a whole: layering, packaging, the image, the documented commands and claims, scripts."""
