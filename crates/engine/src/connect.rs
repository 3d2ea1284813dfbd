//! The run-scoped Connect endpoint: an MCP server over Streamable HTTP,
//! reached with the run's bearer token. Before the first provider call its
//! `tools/list` must be exactly the reviewed pair, or admission fails with
//! `tool_inventory_mismatch`; a call to any other tool is refused.

use std::time::Duration;

use automesh_domain::ErrorCode;
use automesh_domain::Secret;
use rmcp::model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation};
use rmcp::service::{ClientInitializeError, RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ServiceError, ServiceExt};

use crate::provider::ToolSpec;
use automesh_domain::CodedError;

/// The only tools a native run may see and call.
pub const REVIEWED_TOOLS: [&str; 2] = ["search_capabilities", "execute_capability"];

/// Where the run's Connect endpoint is, and its credential.
#[derive(Clone, Debug)]
pub struct ConnectConfig {
    pub url: String,
    /// The run's bearer token; sent only as `Authorization: Bearer`.
    pub token: Secret,
    /// Bound on connecting, listing, and each tool call.
    pub call_timeout: Duration,
}

/// An open, admitted Connect session.
pub struct Connect {
    client: RunningService<RoleClient, ClientConfig>,
    tools: Vec<ToolSpec>,
    call_timeout: Duration,
    server: (String, u16),
}

impl std::fmt::Debug for Connect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connect")
            .field("tools", &self.tools)
            .finish()
    }
}

/// Receipt messages are for people: they name what went wrong in words and
/// never carry a URL or a type name. The detail goes to the log, its URLs
/// removed (a URL may carry a key).
fn init_error(e: ClientInitializeError) -> CodedError {
    if token_refused(&e, e.is_authorization_required()) {
        let message = "the Connect endpoint refused the run's token";
        return CodedError::new(ErrorCode::ConnectUnauthorized, message);
    }
    let message = match &e {
        ClientInitializeError::TransportError { .. }
        | ClientInitializeError::ConnectionClosed(_) => "the Connect endpoint could not be reached",
        ClientInitializeError::JsonRpcError(_) => "the Connect endpoint refused the handshake",
        ClientInitializeError::NoCompatibleProtocolVersion { .. } => {
            "the Connect endpoint speaks no MCP protocol version this engine does"
        }
        _ => "the Connect endpoint answered the handshake with something that is not MCP",
    };
    tool_error(&e, "the Connect handshake failed", message.into())
}

fn call_error(e: ServiceError) -> CodedError {
    let message = match &e {
        // The server's own words about the call.
        ServiceError::McpError(data) => format!(
            "the Connect endpoint refused the call: {}",
            crate::error::without_urls(&data.message)
        ),
        ServiceError::TransportSend(_) | ServiceError::TransportClosed => {
            "the Connect endpoint could not be reached".into()
        }
        ServiceError::Timeout { .. } => "the Connect endpoint did not answer in time".into(),
        _ => "the Connect endpoint answered with something that is not MCP".into(),
    };
    if token_refused(&e, e.is_authorization_required()) {
        let refused = "the Connect endpoint stopped accepting the run's token";
        return CodedError::new(ErrorCode::ConnectTokenExpired, refused);
    }
    tool_error(&e, "a Connect call failed", message)
}

/// Whether the endpoint turned the run's token away (`flagged` by the
/// client, or an HTTP 401 in its words).
fn token_refused(e: &impl std::fmt::Display, flagged: bool) -> bool {
    flagged || e.to_string().contains("401")
}

/// A failed Connect exchange in `message`'s words, its detail logged (as
/// `what`) without its URLs.
fn tool_error(e: &impl std::fmt::Display, what: &str, message: String) -> CodedError {
    tracing::warn!(detail = %crate::error::without_urls(&e.to_string()), "{what}");
    CodedError::new(ErrorCode::ToolError, message)
}

impl Connect {
    /// Connects, lists the tools, and admits the session only if the list is
    /// exactly [`REVIEWED_TOOLS`].
    pub async fn open(config: &ConnectConfig) -> Result<Connect, CodedError> {
        let mut transport_config =
            StreamableHttpClientTransportConfig::with_uri(config.url.clone())
                .auth_header(config.token.expose().to_owned());
        // Every request of the session carries the run's trace context.
        transport_config.custom_headers = crate::trace::headers()
            .into_iter()
            .filter_map(|(name, value)| Some((name?, value)))
            .collect();
        let transport = StreamableHttpClientTransport::from_config(transport_config);
        let hello = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("automesh-native", env!("CARGO_PKG_VERSION")),
        );
        let client = tokio::time::timeout(config.call_timeout, hello.serve(transport))
            .await
            .map_err(|_| {
                CodedError::new(
                    ErrorCode::ToolError,
                    "the Connect endpoint did not answer the handshake in time",
                )
            })?
            .map_err(init_error)?;
        let listed = tokio::time::timeout(config.call_timeout, client.list_all_tools())
            .await
            .map_err(|_| {
                CodedError::new(
                    ErrorCode::ToolError,
                    "the Connect endpoint did not list its tools in time",
                )
            })?
            .map_err(call_error)?;
        let mut names: Vec<String> = listed.iter().map(|t| t.name.to_string()).collect();
        names.sort();
        let mut reviewed: Vec<String> = REVIEWED_TOOLS.iter().map(|s| (*s).to_owned()).collect();
        reviewed.sort();
        if names != reviewed {
            let _ = client.cancel().await;
            return Err(CodedError::new(
                ErrorCode::ToolInventoryMismatch,
                format!("the Connect endpoint lists {names:?}; exactly {reviewed:?} is required"),
            ));
        }
        let tools = listed
            .into_iter()
            .map(|t| ToolSpec {
                name: t.name.to_string(),
                description: t.description.map(|d| d.to_string()).unwrap_or_default(),
                parameters: serde_json::Value::Object((*t.input_schema).clone()),
            })
            .collect();
        Ok(Connect {
            client,
            tools,
            call_timeout: config.call_timeout,
            server: crate::trace::server_of(&config.url),
        })
    }

    /// The Connect endpoint's host and port, for `server.address`.
    pub fn server(&self) -> &(String, u16) {
        &self.server
    }

    /// The admitted tools, as the provider is offered them.
    pub fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    /// Calls a reviewed tool with JSON arguments; returns its text and
    /// whether the tool reported an error.
    pub async fn call(
        &self,
        name: &str,
        arguments_json: &str,
    ) -> Result<(String, bool), CodedError> {
        if !REVIEWED_TOOLS.contains(&name) {
            return Err(CodedError::new(
                ErrorCode::ToolError,
                format!("tool {name:?} is not a reviewed Connect tool"),
            ));
        }
        let arguments =
            match serde_json::from_str::<serde_json::Value>(if arguments_json.trim().is_empty() {
                "{}"
            } else {
                arguments_json
            }) {
                Ok(serde_json::Value::Object(map)) => map,
                _ => {
                    return Ok((
                        format!("the arguments of {name} must be a JSON object"),
                        true,
                    ));
                }
            };
        let params = CallToolRequestParams::new(name.to_owned()).with_arguments(arguments);
        let result = tokio::time::timeout(self.call_timeout, self.client.call_tool(params))
            .await
            .map_err(|_| {
                CodedError::new(
                    ErrorCode::ToolError,
                    format!("{name} did not answer in time"),
                )
            })?
            .map_err(call_error)?;
        let text = result
            .content
            .iter()
            .filter_map(|b| b.as_text())
            .map(|t| t.text.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        Ok((text, result.is_error.unwrap_or(false)))
    }

    /// Ends the session.
    pub async fn close(self) {
        let _ = self.client.cancel().await;
    }
}
