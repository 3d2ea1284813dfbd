//! The codec every generated client and server uses: prost's, except that a
//! request that does not decode (a string field that is not UTF-8, a
//! malformed field) is the caller's fault, INVALID_ARGUMENT, rather than
//! INTERNAL. A response that does not decode is still INTERNAL: then the
//! server is at fault.
//!
//! Which side is decoding is told by the message type: every request message
//! of these contracts is named `…Request` (`buf lint`'s RPC_REQUEST_STANDARD_NAME
//! keeps it so).
//!
//! Its buffers start at 1 KiB rather than tonic's 8 KiB: a call allocates
//! them up front and a stream keeps them for its whole life, so the gateway's
//! thousands of idle runner streams would hold 16 KiB each for nothing. They
//! grow as a larger message needs.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// `tonic_prost::ProstCodec`, with request decode errors as INVALID_ARGUMENT.
/// The codec's buffer settings: 1 KiB to start, tonic's yield threshold.
fn buffers() -> BufferSettings {
    BufferSettings::new(1024, 32 * 1024)
}

#[derive(Debug, Clone)]
pub struct Codec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = RequestAwareDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(buffers())
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestAwareDecoder {
            inner: ProstDecoder::new(buffers()),
        }
    }
}

/// Decodes like prost; a request that does not decode is INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct RequestAwareDecoder<U> {
    inner: ProstDecoder<U>,
}

/// Whether `U` is a request message of these contracts.
fn is_request<U>() -> bool {
    std::any::type_name::<U>().ends_with("Request")
}

impl<U: Message + Default> Decoder for RequestAwareDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|status| {
            if is_request::<U>() {
                let name = std::any::type_name::<U>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("request");
                Status::invalid_argument(format!(
                    "the request is not a valid {name}: {}",
                    status.message()
                ))
            } else {
                status
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn requests_are_told_from_responses() {
        assert!(super::is_request::<crate::v1::GetRunRequest>());
        assert!(super::is_request::<crate::runner::v1::ConnectRequest>());
        assert!(!super::is_request::<crate::v1::GetRunResponse>());
        assert!(!super::is_request::<crate::runner::v1::ConnectResponse>());
    }
}
