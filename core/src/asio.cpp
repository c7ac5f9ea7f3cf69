// The single compilation of Boost.Asio and Boost.Beast for the whole program
// (BOOST_ASIO_SEPARATE_COMPILATION): every other file includes only declarations.
#include <boost/asio/impl/src.hpp>
#include <boost/beast/src.hpp>
