//! The native engine's command-line flags, shared by the processes that
//! run it.

/// The native engine's flags, alike in every process that runs it (the
/// desktop runner, the worker agent): its OpenAI-compatible model provider
/// and the bounds of its loop.
#[derive(Debug, Clone, clap::Args)]
pub struct ProviderFlags {
    /// Native engine: the OpenAI-compatible provider's base URL.
    #[arg(long, env = "AUTOMESH_PROVIDER_URL", default_value = "https://api.openai.com/v1")]
    pub provider_url: String,
    /// Native engine: the provider's API key (sent only as a header).
    #[arg(
        long,
        env = "AUTOMESH_PROVIDER_API_KEY",
        hide_env_values = true,
        default_value = ""
    )]
    pub provider_key: automesh_domain::Secret,
    /// Native engine: use streaming completions.
    #[arg(long, env = "AUTOMESH_PROVIDER_STREAM")]
    pub stream: bool,
    /// Native engine: bound on one provider request.
    #[arg(
        long,
        env = "AUTOMESH_PROVIDER_REQUEST_TIMEOUT",
        default_value = "120s",
        value_parser = automesh_domain::parse_duration
    )]
    pub request_timeout: std::time::Duration,
    /// Native engine: the agent loop's step limit.
    #[arg(long, env = "AUTOMESH_MAX_STEPS", default_value_t = 32)]
    pub max_steps: u32,
}
