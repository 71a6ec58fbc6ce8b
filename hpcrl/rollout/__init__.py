"""Generation: the inference client, hpcrl's CPU server (SGLang's HTTP API), the SGLang launch path."""
