"""The step compiler: capture, bucket pass, overlap pass, donation, fingerprint, backends."""
