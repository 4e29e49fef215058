//! The standalone driver: runs a session on the embedded store (see `drive`).
