"""The step compiler: capture, passes (replication, bucket, overlap, reinplace), plan, backends."""
