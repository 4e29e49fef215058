//! The pure session core (no I/O).
