//! Diagnosis of exhaustion from the host's socket tables: ephemeral ports and TIME_WAIT
//! (`connguard ports`), listeners' accept queues (`connguard listeners`), and what the
//! daemon adds to them. Works without a daemon.
pub mod attribution;
pub mod listeners;
pub mod ports;
